import pytest
import torch

import amp
from helpers.models import make_model


@pytest.fixture
def initialized(request):
    """amp.initialize(model, SGD) at the parametrized level; yields (model, optimizer)."""
    level = getattr(request, "param", "O1")
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    amp.initialize(model, optimizer, opt_level=level, verbosity=0)
    try:
        yield model, optimizer
    finally:
        amp.deinitialize()

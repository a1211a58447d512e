"""apex names that this package keeps importable but does not implement: calling one raises
RuntimeError naming the replacement (apex code often imports names it never uses)."""


def not_provided(qualified_name, replacement):
    """A class that can be imported, subclassed and checked with isinstance, but not created."""

    def __init__(self, *args, **kwargs):
        raise RuntimeError(
            f"{qualified_name} is not provided by amp's apex compatibility package. "
            f"Use {replacement}."
        )

    module, _, name = qualified_name.rpartition(".")
    return type(name, (), {"__init__": __init__, "__module__": module, "__doc__": replacement})

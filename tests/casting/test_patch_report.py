"""The report of the ops amp patches at O1 (amp/casting/patch_report.py): it names exactly what O1
patches, and docs/opt-levels.md holds its current text."""

import torch

import amp
from amp import lists
from amp.casting import patch_report
from amp.patching import is_amp_replacement
from helpers import ROOT


def _namespaces():
    paths = [table.MODULE for table in lists.TABLES]
    paths += [table.C_MODULE for table in lists.TABLES if hasattr(table, "C_MODULE")]
    return {path: lists.resolve_namespace(path) for path in paths}


def test_the_report_names_exactly_what_o1_patches():
    reported = {name for _, _, names in patch_report.rows() for name in names}
    amp.initialize(torch.nn.Linear(2, 2), opt_level="O1", verbosity=0)
    try:
        patched = {
            f"{path}.{name}"
            for path, namespace in _namespaces().items()
            for name, value in vars(namespace).items()
            if value is not None and is_amp_replacement(value)
        }
    finally:
        amp.deinitialize()
    assert patched == reported
    assert "torch.nn.functional.linear" not in patched and "torch.matmul" not in patched


def test_the_docs_show_the_current_report():
    page = (ROOT / "docs" / "opt-levels.md").read_text()
    begin, end = "<!-- o1-patches:begin -->\n", "\n<!-- o1-patches:end -->"
    shown = page[page.index(begin) + len(begin) : page.index(end)]
    assert shown == patch_report.markdown(), "regenerate: python -m amp.casting.patch_report"

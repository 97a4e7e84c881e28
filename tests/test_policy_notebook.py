"""The policy-comparison notebook executes end to end on the committed traces and profile."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")
pytest.importorskip("matplotlib")

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK = ROOT / "notebooks" / "policy_comparison.ipynb"


def test_policy_notebook_executes_on_the_committed_traces(monkeypatch):
    for name in ("ADAPTIVE_SPEC_TRACES", "ADAPTIVE_SPEC_PROFILE"):  # allow pointing it elsewhere when developing
        if os.environ.get(f"TEST_{name}"):
            monkeypatch.setenv(name, os.environ[f"TEST_{name}"])
        else:
            monkeypatch.delenv(name, raising=False)
    monkeypatch.delenv("MPLBACKEND", raising=False)  # the inline backend must render the figure
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    client = nbclient.NotebookClient(notebook, timeout=180, kernel_name="python3",
                                     resources={"metadata": {"path": str(NOTEBOOK.parent)}})
    client.execute()
    outputs = [output for cell in notebook.cells if cell.cell_type == "code" for output in cell.get("outputs", [])]
    assert not [o for o in outputs if o.get("output_type") == "error"]
    text = "".join(o.get("text", "") for o in outputs if o.get("output_type") == "stream")
    assert "fraction of the oracle" in text and "goodput" in text and "oracle" in text
    assert "request-static-oracle" in text and "confidence-oracle" in text  # the ceilings beside the policies
    assert "goodput / confidence-bound" in text  # batch 1: what the draft's confidence can buy
    assert re.search(r"\b[1-9]\d* rows from the committed result files", text)  # results/ read back
    assert [o for o in outputs if "image/png" in o.get("data", {})]

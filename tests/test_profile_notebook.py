"""The profile-analysis notebook executes end to end on the small committed profile."""

from __future__ import annotations

from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")
pytest.importorskip("matplotlib")

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK = ROOT / "notebooks" / "profile_analysis.ipynb"
PROFILE = ROOT / "profiles" / "tiny-test.json"


def test_profile_notebook_executes_on_the_small_profile(monkeypatch):
    monkeypatch.setenv("ADAPTIVE_SPEC_PROFILE", str(PROFILE))
    monkeypatch.delenv("MPLBACKEND", raising=False)  # the inline backend must render the figures
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    client = nbclient.NotebookClient(notebook, timeout=120, kernel_name="python3",
                                     resources={"metadata": {"path": str(NOTEBOOK.parent)}})
    client.execute()
    outputs = [output for cell in notebook.cells if cell.cell_type == "code" for output in cell.get("outputs", [])]
    assert not [o for o in outputs if o.get("output_type") == "error"]
    text = "".join(o.get("text", "") for o in outputs if o.get("output_type") == "stream")
    assert "tiny-test" in text and "median_rel_error" in text
    images = [o for o in outputs if "image/png" in o.get("data", {})]
    assert len(images) >= 3  # latency vs query tokens, leave-one-out errors, goodput vs k

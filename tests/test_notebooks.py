"""Every notebook runs top to bottom in small mode (CPU), as CI executes them."""

import glob
import os

import nbformat
import pytest
from nbclient import NotebookClient

from conftest import REPO_ROOT

NOTEBOOKS = sorted(glob.glob(os.path.join(REPO_ROOT, "notebooks", "*.ipynb")))


def test_there_are_four_notebooks():
    assert [os.path.basename(p)[:2] for p in NOTEBOOKS] == ["01", "02", "03", "04"]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=os.path.basename)
def test_notebook_runs(path, tmp_path):
    notebook = nbformat.read(path, as_version=4)
    # Install cell first, then the device cell: the same cells a Colab user runs.
    assert "pip" in notebook.cells[1].source and "ON_TPU" in notebook.cells[1].source
    assert "colab.research.google.com/github/" in notebook.cells[0].source
    client = NotebookClient(notebook, timeout=600, kernel_name="python3",
                            resources={"metadata": {"path": str(tmp_path)}})
    client.execute()  # raises CellExecutionError if any cell fails
    outputs = [o for cell in notebook.cells if cell.cell_type == "code" for o in cell.get("outputs", [])]
    assert not [o for o in outputs if o.get("output_type") == "error"]
    text = "".join(o.get("text", "") for o in outputs)
    assert "small mode" in text  # this machine has no TPU: the small version ran

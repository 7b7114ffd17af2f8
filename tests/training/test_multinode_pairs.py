"""The other attention x global_batch pairs of test_multinode's two layouts (ring, or context, spanning two processes of
4 simulated CPU devices each), checked the same way; a file of their own, so that the slow tier's workers run the
two halves side by side. They run with JAXLONG_MULTINODE_ALL_PAIRS=1 (about 50 CPU-s each); the slow tier
runs test_multinode's two layouts, which cover each axis across the processes, Ulysses and U-Pipe, both launchers
for both the first run and the resume, and both batch sizes."""

import os

import pytest
from test_multinode import check_layout

ALL = os.environ.get("JAXLONG_MULTINODE_ALL_PAIRS") == "1"

# layout: (overrides, the launcher of the first run, the launcher of the resume and the evaluation)
PAIRS = {
    "ring-spans-batch1": (["mesh.ring=2", "mesh.context=4", "global_batch=1"], "slurm", "hand"),
    "upipe-ring-spans-batch2": (["mesh.ring=2", "mesh.context=4", "attention.impl=upipe", "global_batch=2"],
                                "hand", "hand"),
    "ring-spans-batch2": (["mesh.ring=2", "mesh.context=4", "global_batch=2"], "hand", "hand"),
    "context-spans-batch1": (["mesh.ring=1", "mesh.context=8", "global_batch=1"], "hand", "slurm"),
}


@pytest.mark.subprocess
@pytest.mark.slow
@pytest.mark.skipif(not ALL, reason="the other pairs run with JAXLONG_MULTINODE_ALL_PAIRS=1")
@pytest.mark.parametrize("layout", list(PAIRS))
def test_more_layouts_train_resume_and_evaluate_like_one(tmp_path, layout):
    """Two processes, ring or context spanning them, with the attention and batch pairs test_multinode does not
    run: the same losses, validation loss and evaluation as one process of 8 devices."""
    check_layout(tmp_path, layout, *PAIRS[layout])

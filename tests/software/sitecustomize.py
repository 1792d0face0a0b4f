"""Another torch build on one node, injected from outside the tool: put this directory on PYTHONPATH of the
ranks of one simulated node. torch then reports TEST_TORCH_VERSION (default 2.12.0) as its __version__, as
a node whose image carries another torch would. Processes that are not ranks (the node monitor) are left alone."""
import os

if "_AIV_NODE_MONITOR" not in os.environ:
    import torch

    torch.__version__ = os.environ.get("TEST_TORCH_VERSION", "2.12.0")

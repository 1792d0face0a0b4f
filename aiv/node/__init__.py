"""The node gate (--node-check): what a node reads alone without torch, its judges and contexts, its
summary, NPD line and textfile, and its runtime (the lock, one worker per GPU, the budget, scontrol)."""

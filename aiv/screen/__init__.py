"""The performance screen and the soak: what a device and the fabric measure, the rounds and groups, the
judges of GPUs, nodes, rails and links, the control loop, and the collectives on the ranks."""

"""How the tool is started: the launch contract (torchrun, Slurm, MPI and the Kubernetes launchers), the
one parser of flags and AIV_* variables, what a command line becomes (plan) and the local launcher."""

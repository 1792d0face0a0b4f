"""ddp_mesh_ping.py -- multi-node, multi-GPU preflight for Slurm clusters.

Run it before an expensive training job. It checks that the launcher started the
right ranks, that every rank owns the right GPU, that the software stack matches
across nodes, that the fabric is up, and that NCCL (or gloo on CPU) completes a DDP
all-reduce ring. It never hangs: every distributed phase is bounded by --timeout.

Phases (each prints one progress line on rank 0):
  contract    read RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR / MASTER_PORT
              (fallback: SLURM_PROCID / SLURM_NTASKS / SLURM_LOCALID / first host of
              SLURM_JOB_NODELIST / a port derived from SLURM_JOB_ID; an MPI launcher's);
              a pod of Kubeflow Trainer v2, PyTorchJob v1, an Indexed Job, JobSet,
              LeaderWorkerSet or Volcano (one process per node) starts its node's ranks:
              the table LAUNCHERS in aiv/launch/launchers.py
  local       backend, GPU device, NCCL_SOCKET_IFNAME / GLOO_SOCKET_IFNAME, numpy
  rendezvous  roll call through a TCPStore on MASTER_ADDR:MASTER_PORT, every value signed with
              the job's secret AIV_JOB_SECRET (HMAC-SHA256, bound to the run); rank 0 judges
              layout and GPU affinity before any NCCL communicator exists
  init        torch.distributed.init_process_group on that store
  telemetry   per-rank and per-node facts posted to the store, read by rank 0 in one read, with each
              rank's numerics check (--skip-numerics skips it): seeded bf16/TF32/fp32 matmuls and an
              elementwise kernel whose bits must match the rank's GPU model and software peers and
              whose values must lie within a tolerance of an fp64 reference (silent data corruption)
  judge       small pure checks over the gathered data -> PASS / WARN / FAIL
  screen      performance screen (--skip-screen skips it): each GPU's matmul TFLOPS and memory GB/s
              (measured on a thread of the rank's own from the local checks on, while it waits at the
              roll call and in init, timed on the device), all_reduce busbw inside each node, then
              between pairs of nodes per rail in two rounds and a third for suspects; names the slow
              GPU, node, rail or link
  soak        with --soak SECONDS: bf16 matmul on every GPU at once for SECONDS, clocks, temperature,
              power and clock-event reasons sampled; names the GPU that slows down, overheats or brakes
  collectives exact all_reduce with a closed-form sum, DDP step on nn.Linear(10, 10), each rank's
              own gradients (same input everywhere) compared before the all-reduce, gradients
              compared across ranks after it, loss all_reduced
  verdict     report, one FAILURE line per failed check, or the success line

Launch:
  python ddp_mesh_ping.py                 local mode: one rank per visible GPU, or
                                          --nproc N gloo ranks on CPU (default 2)
  srun python ddp_mesh_ping.py            one rank per Slurm task
  torchrun --nproc-per-node 8 ddp_mesh_ping.py
  python ddp_mesh_ping.py                 in a pod of a Kubernetes launcher: one rank per GPU,
                                          the node's share of the job (docs/kubernetes.md)
  python ddp_mesh_ping.py --verify-log ai_infra_smoke_test_123.log --expect-world-size 16

Exit codes: 0 PASS, 1 FAIL (a check failed), 2 USAGE (bad flags or launch contract,
nothing attempted), 3 TIMEOUT (a deadline passed: missing ranks, unreachable master,
a collective that never completed), 4 INTERNAL (the tool's own error: no host blamed),
5 INTERRUPTED (SIGTERM/SIGINT: scancel, the time limit, preemption, Ctrl-C: no host blamed).
Every mistake in a flag, variable or launch variable is one FAILURE line and exit 2. Every option
but --verify-log can also be set through an environment variable AIV_<OPTION> (e.g.
AIV_TIMEOUT=120); the command line wins.

Stable strings for automation:
  Total Execution Ranks: N
  SUCCESS: DDP Multi-Node AllReduce Ring Complete!
  FAILURE: <check>: <reason>        (check names: see CHECKS below)
"""

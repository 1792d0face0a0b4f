"""Floor 1: every bound in one table (deadlines()) and the small waits beside it, as plain numbers;
aiv/core/bounds.py holds what enforces them (Bound, the watchdog, within)."""

TIMEOUT_DEFAULT = 120.0   # --timeout: each phase after the roll call (NCCL init of 2 H200s takes ~5 s)
ROLLCALL_DEFAULT = 300.0  # --rollcall-timeout: start-up skew of thousands of ranks importing torch
# The roll call's last call (torchrun's rendezvous last_call_timeout, 30 s by default, is the anchor): once at
# least half the world checked in (or failed before it), the ranks never heard of get last_call_grace() past the
# latest arrival, not the whole --rollcall-timeout; a rank that said hello (its process reached the store, still
# importing torch) keeps the whole bound
LAST_CALL_FRACTION = 0.1  # of --rollcall-timeout: 30 s at the default 300 s
LAST_CALL_MIN_S = 5.0     # never less (a short --rollcall-timeout in a test)
LAST_CALL_LAUNCH_X = 2.0  # times what the launch showed: rank 0's start until half the world checked in
HELLO_RETRY_S = 0.5       # a rank's hello to the store, tried again this often until it checks in
NAMING_S = 5.0            # rank 0, once a bound passes: settle liveness, name the culprits, publish
RANK0_GRACE = 15.0        # the other ranks wait this long past their own bound before speaking for rank 0
ACKS_S = 5.0              # rank 0 keeps its store up this long for live ranks to read the verdict
ACKS_SIGNALLED_S = 1.0    # ... or this long once rank 0 itself was signalled (the others are, too: KillWait runs)
ERROR_GRACE = 2.0         # after the first error report: time for other reports and liveness to arrive
MANIFEST_LOCK_S = 10.0    # rank 0 at the verdict: the most it waits for another job's lock on a --save-manifest file
LOCK_RETRY_S = 0.2        # how often that lock is tried again (non-blocking) while another job holds it
# The small waits inside a phase, each also inside the phase's bound (the table below):
NCCL_RELAY_S = 1.0        # a rank's exit: the most it waits for another thread relaying its NCCL WARN lines
STORE_OP_S = 1.0          # one store operation off the main thread (a report after a signal, a clone, a counter)
AUDIT_S = 1.0             # rank 0 at the verdict: every value on the store checked once more (StoreProtocol.audit)
FORGED_POLL_S = 0.1       # a reader that refused a value not of this run looks again this often, within its wait
SNAPSHOT_S = 1.5          # rank 0, after a signal: one read of liveness, of the stamps and of the reports
TERM_REPORTS_S = 0.5      # rank 0, after a signal: time for the other ranks' "terminated" reports to arrive
SIGNAL_SPREAD_S = 2.0     # a rank that lost rank 0's store with no verdict read: the most it waits for a signal of
                          # its own (scancel and the time limit reach each node at its own time) before it speaks
ISSUED_S = 4.0            # rank 0, a collective phase's bound passed: the most it waits (beside the liveness settle,
                          # inside NAMING_S) for each live rank's post of the last collective it issued
NCCL_RAS_S = 3.0          # rank 0, the same moment on NCCL: NCCL's own view (its RAS STATUS), read beside it
RESOLVE_S = 5.0           # a rank's lookup of MASTER_ADDR before it connects (a name that does not resolve is said
                          # at once; a lookup slower than this is left to the store's connect)
TORCH_BACKSTOP_S = 30.0   # torch's own process-group timeout lies this far past our bound: ours fires first
IMPORT_PROBE_S = 60.0     # torchvision/torchaudio import probe: at most this, T/2 at the verdict, T/4 before the screen
MONITOR_CONNECT_S = 5.0   # a node monitor's store connect (1 s when its ranks are gone already: the run ended)
PROBE_CONNECT_S = 0.8     # a raw TCP connect that tells "no listener" from "a listener that never answers"
MARK_TTL = 30.0           # seconds a node's "said" marker silences its siblings; an older one is another run's
OUTPUT_S = 20.0           # rank 0 at the verdict: each requested file (--json, --metrics, --html) written within this
VERDICT_S = 90.0          # rank 0, from the verdict's start to its exit (report, drain, files, manifest, acks); past
                          # it rank 0 exits with the verdict's code (published on the store first) and says so
DRAIN_S = 10.0            # rank 0 at a FAIL verdict with --drain on: both scontrol calls (show, update) together
NODE_SMI_S = 15.0         # a node leader's one nvidia-smi call for all its GPUs (ECC, row remapping), started at
                          # launch: NVML's start without persistence mode takes seconds per GPU; past it "not read"
CHILD_REAP_S = 1.5        # a child killed at its bound: at most this more for it to exit and its pipes to close; then
                          # it is left behind and said (a process stuck in the kernel cannot be reaped)
LAUNCHER_SLACK_S = 30.0   # local launcher: its backstop past the worst case; then 5 s for the others after rank 0
# --node-check: one node's pass, all of it within --node-budget (NODE_BUDGET_DEFAULT, under LBNL NHC's 30 s
# watchdog; Slurm kills a HealthCheckProgram at 60 s)
NODE_BUDGET_DEFAULT = 25.0
NODE_RESERVE_S = 3.0      # of the budget, kept for the verdict: scontrol (once or twice) and the files
NODE_SMI_BOUND_S = 5.0    # each nvidia-smi call of the pass (the GPU list, the compute processes)
NODE_SLURM_BOUND_S = 4.0  # each scontrol call of the pass
NODE_KMSG_BOUND_S = 1.0   # reading the kernel log for Xid lines (and at most 8 MiB of it)
NODE_PREEMPT_S = 5.0      # a prolog waits this long for a health pass it stopped to let go of the GPUs
NODE_HELD_AGAIN_S = 1.0   # prolog, epilog: a process on the job's GPU is looked for again this much later (it counts
                          # only if still there: one tearing down at the job's boundary is gone by then)

PHASES = ("local", "rollcall", "init", "telemetry", "screen-gpu", "screen-net", "soak", "collective", "ddp",
          "bandwidth", "final")
FAN_IN = {"telemetry": "telemetry", "ddp": "results"}  # phase -> what each rank posts to rank 0 through the store
SCREEN_PHASES = ("screen-gpu", "screen-net")  # skipped with --skip-screen
ISSUE_PHASES = ("init", "screen-net", "collective", "ddp", "bandwidth")  # phases whose ranks issue collectives
PHASE_CHECK = {"local": "local", "rollcall": "rendezvous", "init": "init", "telemetry": "telemetry",
               "screen-gpu": "gpu-perf", "screen-net": "inter-node", "soak": "soak",
               "collective": "collective", "ddp": "ddp", "bandwidth": "bandwidth", "final": "verdict"}
PHASE_WHAT = {"local": "import torch and the local checks", "rollcall": "the roll call",
              "init": "init_process_group", "telemetry": "the telemetry gather and judge",
              "screen-gpu": "the GPU screen (matmul and memory copy)",
              "screen-net": "the network screen (all_reduce inside each node and between nodes) and its judgement",
              "soak": "the soak (sustained matmul on every GPU at once)",
              "collective": "all_reduce of rank-encoded integers", "ddp": "the DDP step and results gather",
              "bandwidth": "the bandwidth probe", "final": "the verdict"}


def deadlines(timeout, rollcall_timeout, soak=0.0):
    """The one table of bounds: phase -> seconds. `local` and `rollcall` get --rollcall-timeout, `soak`
    its --soak seconds + --timeout (the load itself, then what any phase does), every other
    later phase --timeout; `manifest-lock` (MANIFEST_LOCK_S, not a phase) bounds the wait for a
    --save-manifest file's lock at the verdict. Invariant (checked by a test): rank 0 names the culprits
    within a phase's bound + NAMING_S, which is below the other ranks' backstop (bound + RANK0_GRACE), so rank 0
    reports before anyone gives up on it."""
    table = {p: float(timeout) for p in PHASES}
    table["local"] = table["rollcall"] = float(rollcall_timeout)
    table["soak"] = float(timeout) + float(soak)
    table["manifest-lock"] = MANIFEST_LOCK_S  # not a phase: part of the verdict, with --save-manifest only
    table["verdict"] = VERDICT_S  # not a phase: rank 0's verdict, once a phase ended or its bound passed
    return table


def worst_case(table, bandwidth=False, screen=True, soak=False):
    """The longest a run takes to its verdict with its files written at once: every phase at its bound, then
    naming and acks. The verdict itself is not counted: it writes the files asked for (--json, --metrics,
    --html, each within OUTPUT_S) before it prints the report and publishes the code, then the drain, the
    manifest and the acknowledgements; on slow storage all of it takes up to VERDICT_S
    (rank 0 posts "deciding" as it starts: the others then wait that long for the code, not RANK0_GRACE)."""
    return sum(s for p, s in table.items() if (bandwidth or p != "bandwidth") and (soak or p != "soak")
               and (screen or p not in SCREEN_PHASES) and p != "verdict") + NAMING_S + ACKS_S


def last_call_grace(rollcall_s, launch_s):
    """Seconds the ranks never heard of get past the latest arrival once the last call began: the larger of
    LAST_CALL_FRACTION of the roll call's bound (30 s at the default) and LAST_CALL_LAUNCH_X times `launch_s`
    (how long half the world took to start, import torch and check in: a slow launch, or a slow filesystem at
    scale, gets a longer last call), at least LAST_CALL_MIN_S, never past the roll call's bound."""
    rollcall_s = float(rollcall_s)
    return min(rollcall_s, max(LAST_CALL_MIN_S, LAST_CALL_FRACTION * rollcall_s, LAST_CALL_LAUNCH_X * float(launch_s)))


class LastCall:
    """The roll call's last call as plain state (pure): seen(now, present, heard) at each look (present: ranks
    checked in or failed before it; heard: those and the ranks that said hello); due(now) once at least half the
    world is present and nothing new was heard for the grace (last_call_grace, fixed when half the world was
    present: launch_s, seconds since the launch's start, is what the launch showed)."""

    def __init__(self, world, rollcall_s, launch_t0):
        self.world, self.rollcall_s, self.t0 = int(world), float(rollcall_s), launch_t0
        self.begun = self.grace = None
        self.heard, self.last = -1, None

    def seen(self, now, present, heard):
        if heard != self.heard:
            self.heard, self.last = heard, now
        if self.begun is None and 2 * present >= self.world:
            self.begun = now
            self.grace = last_call_grace(self.rollcall_s, now - self.t0)
        return self

    def due(self, now):
        return self.begun is not None and now >= max(self.begun, self.last) + self.grace


def live_period(nodes):
    """Seconds between a node monitor's posts (and its leader's beats): two operations per node per
    period keep rank 0's store under ~1,000 operations per second up to 1,000 nodes (8,000 ranks at 8 per
    node). Capped at 2 s, so that two periods fit in the NAMING_S - 1 seconds rank 0 waits for fresh
    liveness; past 1,000 nodes that costs nodes operations per second."""
    return min(2.0, max(1.0, nodes / 500.0))

"""The preflight's runtime: the side channel (the store), liveness, NCCL's RAS view, a rank's background
work, the verdict given once (Conclusion), the phases of a rank (RankRun), rank 0 and the others."""

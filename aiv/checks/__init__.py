"""The checks, shared by every mode: the facts a rank and its node collect (one getter per fact, the
numerics computed on a device) and the judges of them (layout, affinity, software, numerics, who hung,
the manifest)."""

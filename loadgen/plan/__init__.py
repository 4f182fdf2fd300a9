"""``ppd-bench plan``: the shape advisor (which P:D split of N GPUs, in which mode)."""

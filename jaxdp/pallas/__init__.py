"""Pallas GPU kernels for per-example norms and clip-and-aggregate (issue 3/4: not yet implemented)."""

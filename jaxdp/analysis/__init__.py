"""Tools that measure the library rather than train with it: a DP step per method and its measurement
(`throughput`), the DP pieces of one linear layer with their counts and roofline (`kernels`), benchmark
scheduling in a short GPU lease (`held`), a profile summed by kernel kind (`profile`), and
`jaxdp.core.rows.rows_apart`'s A/B patch (`rows_merged`).
The HLO readers are `jaxdp.analysis.hlo_cost` (FLOPs, bytes, launches) and `jaxdp.analysis.collectives`."""

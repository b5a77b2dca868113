"""Tools that measure the library rather than train with it: benchmark scheduling in a short GPU lease
(`held`), a profile summed by kernel kind (`profile`), and `jaxdp.core.rows.rows_apart`'s A/B patch (`rows_merged`).
The HLO readers are `jaxdp.analysis.hlo_cost` (FLOPs, bytes, launches) and `jaxdp.analysis.collectives`."""

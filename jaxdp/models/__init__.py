"""Language models built from `jaxdp.nn` layers."""

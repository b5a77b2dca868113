"""Language models built from `jaxdp.core.nn` layers."""

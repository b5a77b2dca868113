"""Experiments: thin absl mains over jaxdp (the library never imports this package)."""

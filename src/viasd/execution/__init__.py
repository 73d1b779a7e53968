"""How decoding runs model passes: directly, or batched with other requests on the compute thread, through a prefix cache,
timed (`Passes`)."""

"""What a graph costs, modelled: memory traffic, an accelerator's latency and on-chip buffer,
int8 traffic, and the hardware profiles they read (``hardware/*.toml``)."""

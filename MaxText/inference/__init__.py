"""decode.py's driver (loading the params, generating from a prompt, timed) and the decode roofline; the prefill,
decode step, sampling and row sampler it runs are generation/'s."""

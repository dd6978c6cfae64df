"""Analysis of stored features: linear and k-NN probes, linear CKA between layers, figures and the
HTML report; each SAE latent's top contexts (top.py). Reads stores through ``extract.read`` only; never
imports the job or the command lines."""

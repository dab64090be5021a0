"""Device kernels (Triton), each imported behind a check; torch fallbacks live beside them."""

"""The thin pyfuse3 adapter: requests in, errnos out (the one errno boundary)."""

"""Node-local bytes: staging files, the verified chunk cache, buffers, uploads, the publish queue, chunk liveness."""

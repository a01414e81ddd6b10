"""The distributed plumbing under the executor: the point-to-point transport and the failure
board, the process groups pipeswap makes, the peer watch, and launching ranks."""

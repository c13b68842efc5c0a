"""Property tests (hypothesis): a package so their basenames may repeat tests/ ones."""

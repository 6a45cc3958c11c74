"""Watching the window: metrics, the scrape server, hooks, the textfile, and what ties them."""

"""The app over HTTP on a local Ray cluster, beside the servers a user would run instead."""

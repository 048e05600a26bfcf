"""The engine in this process: steps against the machine's floors, and its scheduler under load."""

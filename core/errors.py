class K2Error(Exception):
    """An error the user can fix; the CLI prints it as one line."""

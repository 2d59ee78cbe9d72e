"""Communication: collectives with byte / time accounting and timeouts, and failure
reports that name the rank that failed first."""

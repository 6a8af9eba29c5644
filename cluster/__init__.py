"""Everything between workers: router, routing policies, prefix index, migration, client."""

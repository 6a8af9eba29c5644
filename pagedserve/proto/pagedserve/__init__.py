"""Generated code of the `pagedserve.*` proto packages (see `serving.proto`)."""

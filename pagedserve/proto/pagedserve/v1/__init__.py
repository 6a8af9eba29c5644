"""`serving.proto` and its generated stubs (`python -m pagedserve.proto.generate`)."""

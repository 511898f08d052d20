"""pdserve gRPC API, version 1: generate.proto and its generated modules."""

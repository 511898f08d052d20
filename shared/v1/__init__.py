"""pdserve gRPC API, version 1: generate.proto and its generated modules."""

# for gRPCOptions(grpc_servicer_functions=[...]): how Serve's gRPC proxy learns the service
SERVICER_FUNCTION = "pdserve.v1.generate_pb2_grpc.add_GenerateServiceServicer_to_server"

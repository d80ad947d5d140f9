"""gRPC contracts. The *_pb2*.py files are generated: run `python -m moe_core.gen_protos`."""

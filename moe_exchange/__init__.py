"""Hidden states between the services: the Experts protocol both sides implement, the GPU side's dispatch
(gRPC Exchange stream and the shared-memory channel), the expert side's ring, the wire format and tensor codec."""

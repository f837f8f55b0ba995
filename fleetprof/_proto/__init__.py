"""Code generated from proto/ by scripts/gen_proto.sh: the wire contract (v1) and the kubelet's PodResources API."""

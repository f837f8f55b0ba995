"""The Kubernetes face of the agent: which pod and container own a process or a device on this node."""

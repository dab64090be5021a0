"""Kubernetes manifests for a moeserve deployment (LeaderWorkerSet groups, SGLang's router for
prefill-decode disaggregation), rendered as a dry run: docs/deploy_k8s.md."""

// CoreDNS for the real node of `cargo xtask kube` (see
// xtask/src/kube_node.rs): cluster DNS for pods (headless Services, so that
// a replica's processes find each other by name), with only the plugins
// its Corefile uses.
package main

import (
	"github.com/coredns/coredns/coremain"

	_ "github.com/coredns/coredns/plugin/bind"
	_ "github.com/coredns/coredns/plugin/errors"
	_ "github.com/coredns/coredns/plugin/health"
	_ "github.com/coredns/coredns/plugin/kubernetes"
	_ "github.com/coredns/coredns/plugin/log"
	_ "github.com/coredns/coredns/plugin/ready"
)

func main() {
	coremain.Run()
}

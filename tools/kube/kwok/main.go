// Command kwok is sigs.k8s.io/kwok's `kwok` controller (as its
// cmd/kwok/main.go), with one addition: `kwok stages` prints the default
// stages that kwokctl gives it (node initialize, heartbeat with lease; pod
// ready, complete, delete) as one YAML stream, for its --config.
package main

import (
	"fmt"
	"os"
	"strings"

	"github.com/spf13/pflag"

	nodefast "sigs.k8s.io/kwok/kustomize/stage/node/fast"
	nodeheartbeatwithlease "sigs.k8s.io/kwok/kustomize/stage/node/heartbeat-with-lease"
	podfast "sigs.k8s.io/kwok/kustomize/stage/pod/fast"
	"sigs.k8s.io/kwok/pkg/config"
	"sigs.k8s.io/kwok/pkg/kwok/cmd"
	"sigs.k8s.io/kwok/pkg/log"
	"sigs.k8s.io/kwok/pkg/utils/signals"
)

func main() {
	if len(os.Args) == 2 && os.Args[1] == "stages" {
		stages := []string{
			nodefast.DefaultNodeInit,
			nodeheartbeatwithlease.DefaultNodeHeartbeatWithLease,
			podfast.DefaultPodReady,
			podfast.DefaultPodComplete,
			podfast.DefaultPodDelete,
		}
		for i, s := range stages {
			if i > 0 {
				fmt.Println("---")
			}
			fmt.Println(strings.TrimSpace(s))
		}
		return
	}

	flagset := pflag.NewFlagSet("global", pflag.ContinueOnError)
	flagset.ParseErrorsAllowlist.UnknownFlags = true
	flagset.Usage = func() {}

	ctx := signals.SetupSignalContext()
	ctx, logger := log.InitFlags(ctx, flagset)

	ctx, err := config.InitFlags(ctx, flagset)
	if err != nil {
		_, _ = os.Stderr.Write([]byte(flagset.FlagUsages()))
		logger.Error("Init config flags", "err", err)
		os.Exit(1)
	}

	command := cmd.NewCommand(ctx)
	command.PersistentFlags().AddFlagSet(flagset)
	if err := command.ExecuteContext(ctx); err != nil {
		logger.Error("Execute exit", "err", err)
		os.Exit(1)
	}
}

//go:build !ibverbs

package main

import (
	"fmt"
	"os"
)

func main() {
	fmt.Fprintln(os.Stderr, "vmprobe: built without libibverbs; build with: go build -tags ibverbs ./internal/ibv/vmprobe")
	os.Exit(2)
}

//go:build !(ibverbs && linux && cgo)

// Package ibv is the hardware provider over libibverbs. This build has no
// hardware support: the provider lists no devices and Open fails with an
// error wrapping ErrNotSupported.
package ibv

import (
	"fmt"

	"github.com/goverbs/verbs/internal/prov"
)

// Compiled reports whether the hardware provider is compiled in.
const Compiled = false

// New returns the hardware provider.
func New() prov.Provider { return stub{} }

type stub struct{}

func (stub) Name() string                        { return "ibverbs" }
func (stub) Devices() ([]prov.DeviceInfo, error) { return nil, nil }
func (stub) Open(name string) (prov.Context, error) {
	return nil, fmt.Errorf("device %q: hardware provider not compiled in; build with `-tags ibverbs` on Linux with cgo and libibverbs-dev installed (apt-get install libibverbs-dev): %w", name, prov.ErrNotSupported)
}

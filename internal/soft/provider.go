// Package soft is the pure-Go software provider: device soft0 with verbs
// semantics over in-process memory.
package soft

import (
	"fmt"

	"github.com/goverbs/verbs/internal/prov"
)

// DeviceName is the name of the soft device.
const DeviceName = "soft0"

// New returns the soft provider.
func New() prov.Provider { return provider{} }

type provider struct{}

func (provider) Name() string { return "soft" }
func (provider) Devices() ([]prov.DeviceInfo, error) {
	return []prov.DeviceInfo{{Name: DeviceName, Transport: "software", Provider: "soft"}}, nil
}
func (provider) Open(name string) (prov.Context, error) {
	return nil, fmt.Errorf("soft: open %q: %w", name, prov.ErrNotSupported)
}

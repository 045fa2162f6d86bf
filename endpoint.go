package verbs

import (
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
)

// EndpointVersion is the version of the Endpoint encoding this package writes.
const EndpointVersion = 1

// Transport is the transport of a queue pair.
type Transport uint8

// Transports.
const (
	TransportRC Transport = 2 // reliable connected
	TransportUC Transport = 3 // unreliable connected
	TransportUD Transport = 4 // unreliable datagram
)

func (t Transport) String() string {
	switch t {
	case TransportRC:
		return "RC"
	case TransportUC:
		return "UC"
	case TransportUD:
		return "UD"
	}
	return fmt.Sprintf("Transport(%d)", uint8(t))
}

// MarshalText implements encoding.TextMarshaler.
func (t Transport) MarshalText() ([]byte, error) { return []byte(t.String()), nil }

// UnmarshalText implements encoding.TextUnmarshaler.
func (t *Transport) UnmarshalText(b []byte) error {
	switch string(b) {
	case "RC":
		*t = TransportRC
	case "UC":
		*t = TransportUC
	case "UD":
		*t = TransportUD
	default:
		return fmt.Errorf("verbs: unknown transport %q", b)
	}
	return nil
}

// Endpoint is everything a peer needs to connect to (or address) a queue
// pair. Exchange it out of band: it marshals to a compact binary form
// (MarshalBinary) and to JSON.
type Endpoint struct {
	Version   uint8     `json:"version"`
	Transport Transport `json:"transport"`
	LinkLayer LinkLayer `json:"link_layer"`
	Port      uint8     `json:"port"`
	GIDIndex  uint8     `json:"gid_index"`
	GID       GID       `json:"gid"`
	LID       uint16    `json:"lid"`
	QPN       uint32    `json:"qpn"`
	PSN       uint32    `json:"psn"`
	MTU       MTU       `json:"mtu"`
	QKey      uint32    `json:"qkey,omitempty"`
	// Addr is the provider address (soft provider routing); empty on hardware.
	// It says how to reach the port that owns GID, and does not replace
	// it: an endpoint whose GID was changed is unreachable on soft0 as on
	// hardware.
	Addr []byte `json:"addr,omitempty"`
}

const (
	endpointMagic   = "GVEP"
	endpointFixed   = 4 + 1 + 1 + 1 + 1 + 1 + 16 + 2 + 4 + 4 + 1 + 4 + 2
	maxEndpointAddr = 1024
)

// Validate checks that the endpoint is well formed.
func (e *Endpoint) Validate() error {
	switch {
	case e.Version != EndpointVersion:
		return fmt.Errorf("verbs: endpoint version %d not supported (want %d)", e.Version, EndpointVersion)
	case e.Transport != TransportRC && e.Transport != TransportUC && e.Transport != TransportUD:
		return fmt.Errorf("verbs: endpoint has invalid transport %d", e.Transport)
	case e.QPN == 0 || e.QPN > 0xFFFFFF:
		return fmt.Errorf("verbs: endpoint has invalid qpn %d", e.QPN)
	case e.PSN > 0xFFFFFF:
		return fmt.Errorf("verbs: endpoint has invalid psn %#x (24 bits)", e.PSN)
	case e.MTU.Bytes() == 0:
		return fmt.Errorf("verbs: endpoint has invalid mtu %d", e.MTU)
	case e.LinkLayer != LinkLayerUnspecified && e.LinkLayer != LinkLayerInfiniBand && e.LinkLayer != LinkLayerEthernet:
		return fmt.Errorf("verbs: endpoint has invalid link layer %d", e.LinkLayer)
	case len(e.Addr) > maxEndpointAddr:
		return fmt.Errorf("verbs: endpoint address of %d bytes exceeds %d", len(e.Addr), maxEndpointAddr)
	case e.LinkLayer == LinkLayerInfiniBand && e.LID == 0 && e.GID.IsZero():
		return errors.New("verbs: endpoint has neither lid nor gid")
	}
	return nil
}

// MarshalBinary encodes the endpoint (magic "GVEP", version, fields in
// network byte order, provider address).
func (e Endpoint) MarshalBinary() ([]byte, error) {
	if err := e.Validate(); err != nil {
		return nil, err
	}
	b := make([]byte, 0, endpointFixed+len(e.Addr))
	b = append(b, endpointMagic...)
	b = append(b, e.Version, byte(e.Transport), byte(e.LinkLayer), e.Port, e.GIDIndex)
	b = append(b, e.GID[:]...)
	b = binary.BigEndian.AppendUint16(b, e.LID)
	b = binary.BigEndian.AppendUint32(b, e.QPN)
	b = binary.BigEndian.AppendUint32(b, e.PSN)
	b = append(b, byte(e.MTU))
	b = binary.BigEndian.AppendUint32(b, e.QKey)
	b = binary.BigEndian.AppendUint16(b, uint16(len(e.Addr)))
	b = append(b, e.Addr...)
	return b, nil
}

// UnmarshalBinary decodes and validates an endpoint.
func (e *Endpoint) UnmarshalBinary(b []byte) error {
	if len(b) < endpointFixed {
		return fmt.Errorf("verbs: endpoint: %d bytes is too short (want at least %d)", len(b), endpointFixed)
	}
	if string(b[:4]) != endpointMagic {
		return fmt.Errorf("verbs: endpoint: bad magic %q", b[:4])
	}
	var v Endpoint
	v.Version, v.Transport, v.LinkLayer, v.Port, v.GIDIndex = b[4], Transport(b[5]), LinkLayer(b[6]), b[7], b[8]
	if v.Version != EndpointVersion {
		return fmt.Errorf("verbs: endpoint version %d not supported (want %d)", v.Version, EndpointVersion)
	}
	copy(v.GID[:], b[9:25])
	v.LID = binary.BigEndian.Uint16(b[25:])
	v.QPN = binary.BigEndian.Uint32(b[27:])
	v.PSN = binary.BigEndian.Uint32(b[31:])
	v.MTU = MTU(b[35])
	v.QKey = binary.BigEndian.Uint32(b[36:])
	n := int(binary.BigEndian.Uint16(b[40:]))
	if len(b) != endpointFixed+n {
		return fmt.Errorf("verbs: endpoint: length %d does not match its address length %d", len(b), n)
	}
	if n > 0 {
		v.Addr = append([]byte(nil), b[endpointFixed:]...)
	}
	if err := v.Validate(); err != nil {
		return err
	}
	*e = v
	return nil
}

// UnmarshalJSON decodes and validates an endpoint.
func (e *Endpoint) UnmarshalJSON(b []byte) error {
	type plain Endpoint
	var v plain
	if err := json.Unmarshal(b, &v); err != nil {
		return fmt.Errorf("verbs: endpoint: %w", err)
	}
	ep := Endpoint(v)
	if err := ep.Validate(); err != nil {
		return err
	}
	*e = ep
	return nil
}

func (e Endpoint) String() string {
	return fmt.Sprintf("%s qpn=%d psn=%#x gid=%s lid=%d mtu=%s", e.Transport, e.QPN, e.PSN, e.GID, e.LID, e.MTU)
}

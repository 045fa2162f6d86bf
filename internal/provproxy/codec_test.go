package provproxy

import (
	"bytes"
	"errors"
	"fmt"
	"reflect"
	"syscall"
	"testing"

	"github.com/goverbs/verbs/internal/prov"
)

// fill sets every exported field of the value v points to, recursively, to
// a value derived from *n (slices get two elements), so that a round trip
// that loses or swaps a field shows.
func fill(v reflect.Value, n *int) {
	*n++
	switch v.Kind() {
	case reflect.Bool:
		v.SetBool(*n%2 == 1)
	case reflect.Uint8, reflect.Uint16, reflect.Uint32, reflect.Uint64, reflect.Uint:
		v.SetUint(uint64(*n) * 0x0101010101010101 >> (64 - v.Type().Bits()))
	case reflect.Int8, reflect.Int16, reflect.Int32, reflect.Int64, reflect.Int:
		v.SetInt(-int64(*n))
	case reflect.String:
		v.SetString(fmt.Sprintf("s%d", *n))
	case reflect.Slice:
		s := reflect.MakeSlice(v.Type(), 2, 2)
		for i := range 2 {
			fill(s.Index(i), n)
		}
		v.Set(s)
	case reflect.Array:
		for i := range v.Len() {
			fill(v.Index(i), n)
		}
	case reflect.Struct:
		for i := range v.NumField() {
			if v.Type().Field(i).IsExported() {
				fill(v.Field(i), n)
			}
		}
	}
}

// filled returns a new value of the type v points to, filled.
func filled(v any) any {
	p := reflect.New(reflect.TypeOf(v).Elem())
	n := 0
	fill(p.Elem(), &n)
	return p.Interface()
}

// TestCodecRoundTrip encodes a filled request and response of every
// operation and decodes them back.
func TestCodecRoundTrip(t *testing.T) {
	for op := opcode(1); op < numOps; op++ {
		for _, v := range []any{reqType(op), respType(op)} {
			want := filled(v)
			b, err := marshal(nil, want)
			if err != nil {
				t.Fatalf("%s: marshal %T: %v", op, want, err)
			}
			got := reflect.New(reflect.TypeOf(v).Elem()).Interface()
			if err := unmarshal(b, got); err != nil {
				t.Fatalf("%s: unmarshal %T: %v", op, got, err)
			}
			if !reflect.DeepEqual(got, want) {
				t.Errorf("%s: %T round trip:\n got %+v\nwant %+v", op, v, got, want)
			}
			// Every strict prefix is malformed, and so is a trailing byte.
			for i := range b {
				if err := unmarshal(b[:i], reflect.New(reflect.TypeOf(v).Elem()).Interface()); !errors.Is(err, errMalformed) {
					t.Fatalf("%s: %T from %d of %d bytes: %v, want errMalformed", op, v, i, len(b), err)
				}
			}
			if err := unmarshal(append(b, 0), reflect.New(reflect.TypeOf(v).Elem()).Interface()); !errors.Is(err, errMalformed) {
				t.Errorf("%s: %T with a trailing byte: %v, want errMalformed", op, v, err)
			}
		}
	}
}

// TestWireError checks that errors keep their errno and sentinels across
// the connection.
func TestWireError(t *testing.T) {
	for _, err := range []error{
		fmt.Errorf("soft: post recv: bad: %w", syscall.EINVAL),
		fmt.Errorf("full: %w", &prov.Errno{Sentinel: prov.ErrQueueFull, Errno: syscall.ENOMEM}),
		fmt.Errorf("closed: %w", prov.ErrClosed),
		fmt.Errorf("no: %w", prov.ErrNotSupported),
		fmt.Errorf("plain unsupported: %w", errors.ErrUnsupported),
		fmt.Errorf("wait: %w", errors.Join(prov.ErrTimeout, errors.New("x"))),
	} {
		w := toWire(err)
		b, merr := marshal(nil, w)
		if merr != nil {
			t.Fatal(merr)
		}
		var back wireError
		if err := unmarshal(b, &back); err != nil {
			t.Fatal(err)
		}
		got := back.err()
		if got.Error() != err.Error() {
			t.Errorf("message %q, want %q", got, err)
		}
		for _, s := range append(sentinels, syscall.EINVAL, syscall.ENOMEM) {
			if errors.Is(got, s) != errors.Is(err, s) {
				t.Errorf("%q: errors.Is(_, %v) = %v after the trip, %v before", err, s, errors.Is(got, s), errors.Is(err, s))
			}
		}
	}
	if toWire(nil).err() != nil {
		t.Errorf("nil error did not stay nil")
	}
}

// FuzzDecode decodes arbitrary packets as every message the peers
// exchange: decoding must never panic, and whatever decodes must encode to
// bytes that decode to the same value.
func FuzzDecode(f *testing.F) {
	for op := opcode(1); op < numOps; op++ {
		req, _ := marshal(appendHeader(nil, header{kind: kindRequest, op: op, id: uint64(op)}), filled(reqType(op)))
		f.Add(req)
		resp, _ := marshal(appendHeader(nil, header{kind: kindResponse, op: op, id: uint64(op)}), toWire(syscall.EINVAL))
		resp, _ = marshal(resp, filled(respType(op)))
		f.Add(resp)
	}
	f.Add(appendHeader(nil, header{kind: kindCancel, id: 7}))
	f.Fuzz(func(t *testing.T, data []byte) {
		h, payload, err := parseHeader(data)
		if err != nil {
			if !errors.Is(err, errMalformed) {
				t.Fatalf("parseHeader: %v, want errMalformed", err)
			}
			return
		}
		if req := reqType(h.op); req != nil {
			if err := unmarshal(payload, req); err == nil {
				roundTrip(t, req)
			} else if !errors.Is(err, errMalformed) {
				t.Fatalf("request: %v, want errMalformed", err)
			}
		}
		if resp := respType(h.op); resp != nil {
			var w wireError
			if err := unmarshal(payload, &w, resp); err == nil {
				roundTrip(t, &w)
				roundTrip(t, resp)
				_ = w.err()
			} else if !errors.Is(err, errMalformed) {
				t.Fatalf("response: %v, want errMalformed", err)
			}
		}
	})
}

func roundTrip(t *testing.T, v any) {
	t.Helper()
	b, err := marshal(nil, v)
	if err != nil {
		t.Fatalf("marshal %T: %v", v, err)
	}
	back := reflect.New(reflect.TypeOf(v).Elem()).Interface()
	if err := unmarshal(b, back); err != nil {
		t.Fatalf("unmarshal %T of its own encoding: %v", v, err)
	}
	b2, err := marshal(nil, back)
	if err != nil || !bytes.Equal(b, b2) {
		t.Fatalf("%T encodes to %x, decoded and encoded again to %x (%v)", v, b, b2, err)
	}
}

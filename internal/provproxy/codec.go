package provproxy

import (
	"encoding/binary"
	"errors"
	"fmt"
	"math"
	"reflect"
)

// The payload encoding: a value is encoded field by field, in declaration
// order, with nothing between fields and no type information (both sides
// know the type from the message's operation):
//
//	bool                    1 byte, 0 or 1
//	uint8..uint64, uint     1, 2, 4, 8, 8 bytes, little endian
//	int8..int64, int        1, 2, 4, 8, 8 bytes, two's complement
//	string, []byte          uvarint length, then the bytes
//	[]T                     uvarint count, then each element
//	[N]T                    the N elements
//	struct                  its exported fields (blank and unexported
//	                        fields are skipped)
//
// Decoding checks every length against the bytes that remain, refuses
// unused trailing bytes and never panics on malformed input: it returns
// an error wrapping errMalformed.

// errMalformed is wrapped by every decoding error.
var errMalformed = errors.New("malformed message")

// marshal appends the encoding of v, a struct or a pointer to one, to b.
func marshal(b []byte, v any) ([]byte, error) {
	rv := reflect.ValueOf(v)
	if rv.Kind() == reflect.Pointer && !rv.IsNil() {
		rv = rv.Elem()
	}
	return appendValue(b, rv)
}

func appendValue(b []byte, v reflect.Value) ([]byte, error) {
	switch v.Kind() {
	case reflect.Bool:
		if v.Bool() {
			return append(b, 1), nil
		}
		return append(b, 0), nil
	case reflect.Uint8:
		return append(b, uint8(v.Uint())), nil
	case reflect.Uint16:
		return binary.LittleEndian.AppendUint16(b, uint16(v.Uint())), nil
	case reflect.Uint32:
		return binary.LittleEndian.AppendUint32(b, uint32(v.Uint())), nil
	case reflect.Uint64, reflect.Uint:
		return binary.LittleEndian.AppendUint64(b, v.Uint()), nil
	case reflect.Int8:
		return append(b, uint8(v.Int())), nil
	case reflect.Int16:
		return binary.LittleEndian.AppendUint16(b, uint16(v.Int())), nil
	case reflect.Int32:
		return binary.LittleEndian.AppendUint32(b, uint32(v.Int())), nil
	case reflect.Int64, reflect.Int:
		return binary.LittleEndian.AppendUint64(b, uint64(v.Int())), nil
	case reflect.String:
		b = binary.AppendUvarint(b, uint64(v.Len()))
		return append(b, v.String()...), nil
	case reflect.Slice:
		b = binary.AppendUvarint(b, uint64(v.Len()))
		if v.Type().Elem().Kind() == reflect.Uint8 {
			return append(b, v.Bytes()...), nil
		}
		fallthrough
	case reflect.Array:
		var err error
		for i := range v.Len() {
			if b, err = appendValue(b, v.Index(i)); err != nil {
				return b, err
			}
		}
		return b, nil
	case reflect.Struct:
		t := v.Type()
		var err error
		for i := range t.NumField() {
			if !t.Field(i).IsExported() {
				continue
			}
			if b, err = appendValue(b, v.Field(i)); err != nil {
				return b, err
			}
		}
		return b, nil
	}
	// A programming error: a message type with a field the encoding
	// does not cover.
	return b, fmt.Errorf("provproxy: cannot encode a %v", v.Kind())
}

// unmarshal decodes data, which must be exactly the encodings of vs one
// after the other, into the structs that vs point to.
func unmarshal(data []byte, vs ...any) error {
	d := decoder{b: data}
	for _, v := range vs {
		rv := reflect.ValueOf(v)
		if rv.Kind() != reflect.Pointer || rv.IsNil() {
			return fmt.Errorf("provproxy: decode into %T: not a pointer", v)
		}
		d.value(rv.Elem())
	}
	if d.err == nil && len(d.b) > 0 {
		d.fail("%d unused bytes at the end", len(d.b))
	}
	return d.err
}

// decoder reads values from b; the first error sticks.
type decoder struct {
	b   []byte
	err error
}

func (d *decoder) fail(format string, args ...any) {
	if d.err == nil {
		d.err = fmt.Errorf("%w: "+format, append([]any{errMalformed}, args...)...)
	}
}

// take returns the next n bytes, or nil after an error.
func (d *decoder) take(n int, what reflect.Type) []byte {
	if d.err != nil {
		return nil
	}
	if n > len(d.b) {
		d.fail("%s needs %d bytes, %d left", what, n, len(d.b))
		return nil
	}
	p := d.b[:n]
	d.b = d.b[n:]
	return p
}

// length reads a length prefix: a uvarint that cannot exceed the bytes
// left (every element takes at least one byte, except elements of empty
// types, which no message has).
func (d *decoder) length(what reflect.Type) int {
	if d.err != nil {
		return 0
	}
	n, k := binary.Uvarint(d.b)
	if k <= 0 {
		d.fail("bad length of %s", what)
		return 0
	}
	d.b = d.b[k:]
	if n > uint64(len(d.b)) || n > math.MaxInt32 {
		d.fail("%s of length %d, %d bytes left", what, n, len(d.b))
		return 0
	}
	return int(n)
}

func (d *decoder) value(v reflect.Value) {
	if d.err != nil {
		return
	}
	t := v.Type()
	switch v.Kind() {
	case reflect.Bool:
		if p := d.take(1, t); p != nil {
			if p[0] > 1 {
				d.fail("bool %d", p[0])
				return
			}
			v.SetBool(p[0] == 1)
		}
	case reflect.Uint8:
		if p := d.take(1, t); p != nil {
			v.SetUint(uint64(p[0]))
		}
	case reflect.Uint16:
		if p := d.take(2, t); p != nil {
			v.SetUint(uint64(binary.LittleEndian.Uint16(p)))
		}
	case reflect.Uint32:
		if p := d.take(4, t); p != nil {
			v.SetUint(uint64(binary.LittleEndian.Uint32(p)))
		}
	case reflect.Uint64, reflect.Uint:
		if p := d.take(8, t); p != nil {
			v.SetUint(binary.LittleEndian.Uint64(p))
		}
	case reflect.Int8:
		if p := d.take(1, t); p != nil {
			v.SetInt(int64(int8(p[0])))
		}
	case reflect.Int16:
		if p := d.take(2, t); p != nil {
			v.SetInt(int64(int16(binary.LittleEndian.Uint16(p))))
		}
	case reflect.Int32:
		if p := d.take(4, t); p != nil {
			v.SetInt(int64(int32(binary.LittleEndian.Uint32(p))))
		}
	case reflect.Int64, reflect.Int:
		if p := d.take(8, t); p != nil {
			v.SetInt(int64(binary.LittleEndian.Uint64(p)))
		}
	case reflect.String:
		n := d.length(t)
		if p := d.take(n, t); p != nil {
			v.SetString(string(p))
		}
	case reflect.Slice:
		n := d.length(t)
		if d.err != nil {
			return
		}
		if t.Elem().Kind() == reflect.Uint8 {
			if p := d.take(n, t); p != nil && n > 0 {
				v.SetBytes(append([]byte(nil), p...))
			}
			return
		}
		if n == 0 {
			v.SetZero()
			return
		}
		s := reflect.MakeSlice(t, n, n)
		for i := range n {
			d.value(s.Index(i))
		}
		v.Set(s)
	case reflect.Array:
		for i := range v.Len() {
			d.value(v.Index(i))
		}
	case reflect.Struct:
		for i := range t.NumField() {
			if t.Field(i).IsExported() {
				d.value(v.Field(i))
			}
		}
	default:
		d.err = fmt.Errorf("provproxy: cannot decode a %s", t)
	}
}

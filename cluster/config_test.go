package cluster_test

import (
	"encoding/json"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/google/go-cmp/cmp"
	"github.com/goverbs/verbs/cluster"
)

func TestParseConfig(t *testing.T) {
	in := `{"hosts":[
		{"hostname":"node1","port":18515,"device":"mlx5_0","rank":0},
		{"hostname":"10.0.0.2","port":18516,"rank":1},
		{"hostname":"::1","port":1,"device":"soft0","rank":2}
	]}`
	c, err := cluster.ParseConfig([]byte(in))
	if err != nil {
		t.Fatal(err)
	}
	want := &cluster.Config{Hosts: []cluster.Host{
		{Hostname: "node1", Port: 18515, Device: "mlx5_0", Rank: 0},
		{Hostname: "10.0.0.2", Port: 18516, Rank: 1},
		{Hostname: "::1", Port: 1, Device: "soft0", Rank: 2},
	}}
	if diff := cmp.Diff(want, c); diff != "" {
		t.Errorf("(-want +got):\n%s", diff)
	}
	if got := c.Addrs(); !cmp.Equal(got, []string{"node1:18515", "10.0.0.2:18516", "[::1]:1"}) {
		t.Errorf("Addrs = %q", got)
	}
	// Marshal and parse again.
	b, err := json.Marshal(c)
	if err != nil {
		t.Fatal(err)
	}
	c2, err := cluster.ParseConfig(b)
	if err != nil {
		t.Fatal(err)
	}
	if diff := cmp.Diff(c, c2); diff != "" {
		t.Errorf("round trip (-want +got):\n%s", diff)
	}
}

func TestParseConfigErrors(t *testing.T) {
	h := func(s ...string) string { return `{"hosts":[` + strings.Join(s, ",") + `]}` }
	for _, tc := range []struct {
		name  string
		in    string
		want  error
		index int
		text  string // in the message, if set
	}{
		{"empty file", ``, cluster.ErrSyntax, -1, "is empty"},
		{"blank file", " \n\t\n", cluster.ErrSyntax, -1, "is empty"},
		{"not json", `hosts: []`, cluster.ErrSyntax, -1, "line 1, column 1:"},
		{"bad json on line 3", "{\"hosts\":[\n {\"hostname\":\"a\",\"port\":1,\"rank\":0},\n {\"hostname\":\"b\" \"port\":2,\"rank\":1}\n]}", cluster.ErrSyntax, -1, "line 3, column 18:"},
		{"truncated", "{\"hosts\":[\n {\"hostname\":\"a\",", cluster.ErrSyntax, -1, "line 2, column 18:"},
		{"wrong type on line 2", "{\"hosts\":[\n  {\"hostname\":\"a\",\"port\":\"1\",\"rank\":0}]}", cluster.ErrSyntax, -1, "line 2, column 28:"},
		{"unknown field on line 3", "{\"hosts\":[\n  {\"hostname\":\"a\",\"port\":1,\n   \"ip\":\"x\",\"rank\":0}]}", cluster.ErrSyntax, -1, "line 3, column 4:"},
		{"trailing data on line 2", "{\"hosts\":[{\"hostname\":\"a\",\"port\":1,\"rank\":0}]}\n  {}", cluster.ErrSyntax, -1, "line 2, column 3:"},
		{"no hosts", `{}`, cluster.ErrNoHosts, -1, ""},
		{"empty hosts", h(), cluster.ErrNoHosts, -1, ""},
		{"null hosts", `{"hosts":null}`, cluster.ErrNoHosts, -1, ""},
		{"unknown field", `{"hosts":[],"extra":1}`, cluster.ErrSyntax, -1, ""},
		{"unknown host field", h(`{"hostname":"a","port":1,"rank":0,"ip":"x"}`), cluster.ErrSyntax, -1, ""},
		{"trailing data", h(`{"hostname":"a","port":1,"rank":0}`) + `{}`, cluster.ErrSyntax, -1, ""},
		{"wrong type", h(`{"hostname":"a","port":"1","rank":0}`), cluster.ErrSyntax, -1, ""},
		{"first rank", h(`{"hostname":"a","port":1,"rank":1}`), cluster.ErrFirstRank, 0, ""},
		{"negative first rank", h(`{"hostname":"a","port":1,"rank":-1}`), cluster.ErrFirstRank, 0, ""},
		{"gap", h(`{"hostname":"a","port":1,"rank":0}`, `{"hostname":"b","port":1,"rank":2}`), cluster.ErrRankGap, 1, ""},
		{"out of order", h(`{"hostname":"a","port":1,"rank":0}`, `{"hostname":"b","port":1,"rank":2}`, `{"hostname":"c","port":1,"rank":1}`), cluster.ErrRankGap, 1, ""},
		{"duplicate", h(`{"hostname":"a","port":1,"rank":0}`, `{"hostname":"b","port":1,"rank":1}`, `{"hostname":"c","port":1,"rank":1}`), cluster.ErrDuplicateRank, 2, ""},
		{"duplicate zero", h(`{"hostname":"a","port":1,"rank":0}`, `{"hostname":"b","port":1,"rank":0}`), cluster.ErrDuplicateRank, 1, ""},
		{"missing rank", h(`{"hostname":"a","port":1}`), cluster.ErrMissingRank, 0, ""},
		{"missing port", h(`{"hostname":"a","rank":0}`), cluster.ErrBadPort, 0, ""},
		{"port 0", h(`{"hostname":"a","port":0,"rank":0}`), cluster.ErrBadPort, 0, ""},
		{"port too large", h(`{"hostname":"a","port":65536,"rank":0}`), cluster.ErrBadPort, 0, ""},
		{"negative port", h(`{"hostname":"a","port":-5,"rank":0}`), cluster.ErrBadPort, 0, ""},
		{"empty hostname", h(`{"hostname":"","port":1,"rank":0}`), cluster.ErrBadHostname, 0, ""},
		{"hostname with space", h(`{"hostname":"a b","port":1,"rank":0}`), cluster.ErrBadHostname, 0, ""},
		{"hostname with port", h(`{"hostname":"a:1","port":1,"rank":0}`), cluster.ErrBadHostname, 0, ""},
		{"hostname with empty label", h(`{"hostname":"a..b","port":1,"rank":0}`), cluster.ErrBadHostname, 0, ""},
		{"duplicate address", h(`{"hostname":"a","port":1,"rank":0}`, `{"hostname":"a","port":1,"rank":1}`), cluster.ErrDuplicateAddress, 1, ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := cluster.ParseConfig([]byte(tc.in))
			if !errors.Is(err, tc.want) {
				t.Fatalf("%v, want %v", err, tc.want)
			}
			var ce *cluster.ConfigError
			if !errors.As(err, &ce) {
				t.Fatalf("%T is not a *ConfigError", err)
			}
			if ce.Index != tc.index {
				t.Errorf("index %d, want %d (%v)", ce.Index, tc.index, err)
			}
			if !strings.HasPrefix(err.Error(), "cluster: config: ") {
				t.Errorf("message %q lacks the package prefix", err)
			}
			if !strings.Contains(err.Error(), tc.text) {
				t.Errorf("message %q does not say %q", err, tc.text)
			}
		})
	}
}

func TestLoadConfig(t *testing.T) {
	dir := t.TempDir()
	p := filepath.Join(dir, "net.json")
	if err := os.WriteFile(p, []byte(`{"hosts":[{"hostname":"localhost","port":9000,"rank":0}]}`), 0o600); err != nil {
		t.Fatal(err)
	}
	c, err := cluster.LoadConfig(p)
	if err != nil {
		t.Fatal(err)
	}
	if c.Size() != 1 || c.Hosts[0].Addr() != "localhost:9000" {
		t.Errorf("%+v", c)
	}
	if _, err := cluster.LoadConfig(filepath.Join(dir, "missing.json")); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("missing file: %v", err)
	}
	big := filepath.Join(dir, "big.json")
	if err := os.WriteFile(big, make([]byte, cluster.MaxConfigSize+1), 0o600); err != nil {
		t.Fatal(err)
	}
	if _, err := cluster.LoadConfig(big); !errors.Is(err, cluster.ErrSyntax) {
		t.Errorf("oversized file: %v, want ErrSyntax", err)
	}
}

// FuzzParseConfig: no input panics; an accepted configuration is valid
// and survives a JSON round trip.
func FuzzParseConfig(f *testing.F) {
	f.Add([]byte(`{"hosts":[{"hostname":"a","port":1,"rank":0},{"hostname":"b","port":2,"device":"soft0","rank":1}]}`))
	f.Add([]byte(`{"hosts":[{"hostname":"::1","port":65535,"rank":0}]}`))
	f.Add([]byte(`{"hosts":[{"hostname":"a","port":1,"rank":1}]}`))
	f.Add([]byte(`{"hosts":[]} `))
	f.Fuzz(func(t *testing.T, b []byte) {
		c, err := cluster.ParseConfig(b)
		if err != nil {
			var ce *cluster.ConfigError
			if !errors.As(err, &ce) {
				t.Fatalf("error %v is not a *ConfigError", err)
			}
			return
		}
		if err := c.Validate(); err != nil {
			t.Fatalf("accepted config fails Validate: %v", err)
		}
		out, err := json.Marshal(c)
		if err != nil {
			t.Fatal(err)
		}
		c2, err := cluster.ParseConfig(out)
		if err != nil {
			t.Fatalf("round trip: %v\n%s", err, out)
		}
		if diff := cmp.Diff(c, c2); diff != "" {
			t.Fatalf("round trip (-want +got):\n%s", diff)
		}
	})
}

package cluster

import (
	"fmt"
	"strconv"
	"strings"
)

// MaxNodeList bounds the number of host names ExpandNodeList produces.
const MaxNodeList = 1 << 16

// maxNodeName bounds the length of one name of a node list: a host name
// has at most 253 characters. With MaxNodeList, it bounds what a list
// expands to (16 MiB), whatever the length of its text.
const maxNodeName = 253

// ExpandNodeList expands a Slurm node list (SLURM_JOB_NODELIST) into host
// names, in order: "node[01-03,07],login,rack[1-2]-n[1-2]" gives node01,
// node02, node03, node07, login, rack1-n1, rack1-n2, rack2-n1, rack2-n2.
// A range keeps the zero padding of its lower bound. Lists of more than
// MaxNodeList names, names longer than a host name may be (253
// characters), unbalanced brackets, empty names and reversed ranges are
// errors.
func ExpandNodeList(s string) ([]string, error) {
	if strings.TrimSpace(s) == "" {
		return nil, fmt.Errorf("cluster: node list: empty")
	}
	var out []string
	for _, item := range splitTop(s) {
		if item == "" {
			return nil, fmt.Errorf("cluster: node list %s: empty name", clip(s))
		}
		// Every bracket group adds at least a digit to every name it
		// makes: an item of more groups than a name has characters makes
		// none. Refused first, it bounds the recursion of expandItem (one
		// level per group) to maxNodeName levels, whatever the length of
		// the list.
		if g := strings.Count(item, "["); g > maxNodeName {
			return nil, fmt.Errorf("cluster: node list %s: %d bracket groups in %s make names of more than %d characters", clip(s), g, clip(item), maxNodeName)
		}
		names, err := expandItem(item, MaxNodeList-len(out))
		if err != nil {
			return nil, fmt.Errorf("cluster: node list %s: %w", clip(s), err)
		}
		out = append(out, names...)
	}
	return out, nil
}

// clipLen bounds how much of a node list its errors quote.
const clipLen = 64

// clip quotes s for an error, cut to clipLen bytes with its length: a
// node list, or any value of the environment, may be as long as an
// environment variable (128 KiB), and so would every error that quoted
// it.
func clip(s string) string {
	if len(s) <= clipLen {
		return strconv.Quote(s)
	}
	return fmt.Sprintf("%q... (%d bytes)", s[:clipLen], len(s))
}

// splitTop splits s at the commas outside brackets.
func splitTop(s string) []string {
	var parts []string
	depth, start := 0, 0
	for i := 0; i < len(s); i++ {
		switch s[i] {
		case '[':
			depth++
		case ']':
			depth--
		case ',':
			if depth == 0 {
				parts = append(parts, s[start:i])
				start = i + 1
			}
		}
	}
	return append(parts, s[start:])
}

// expandItem expands one name with bracket groups, producing at most
// limit names. It parses the whole item first, and checks how many
// names it makes and how long the longest is before it builds any:
// then each name is built once, in order (the first group varies
// slowest), and nothing else is allocated. (Expanding group by group,
// from the last, copied every name at every group: 200 groups of one
// number before [0-65535] allocated 1.3 GB to make 13 MB of names.)
func expandItem(item string, limit int) ([]string, error) {
	// The item is lits[0] groups[0] lits[1] groups[1] ... lits[k].
	var lits []string
	var groups [][]string // the numbers of each group, formatted
	count, longest := 1, 0
	rest := item
	for {
		open := strings.IndexByte(rest, '[')
		if open < 0 {
			break
		}
		end := strings.IndexByte(rest[open:], ']')
		if end < 0 {
			return nil, fmt.Errorf("unbalanced '[' in %s", clip(item))
		}
		end += open
		lit, body := rest[:open], rest[open+1:end]
		if strings.ContainsAny(lit, "] \t") || strings.ContainsRune(body, '[') {
			return nil, fmt.Errorf("bad name %s", clip(item))
		}
		// The ranges first: how many numbers, how wide, before any is
		// formatted.
		type span struct {
			a, b uint64
			lo   string
		}
		var spans []span
		size, width := 0, 0
		for _, r := range strings.Split(body, ",") {
			lo, hi, ok := strings.Cut(r, "-")
			if !ok {
				hi = lo
			}
			a, err1 := strconv.ParseUint(lo, 10, 32)
			b, err2 := strconv.ParseUint(hi, 10, 32)
			if err1 != nil || err2 != nil || lo == "" || hi == "" {
				return nil, fmt.Errorf("bad range %s in %s", clip(r), clip(item))
			}
			if b < a {
				return nil, fmt.Errorf("reversed range %s in %s", clip(r), clip(item))
			}
			// Every name of the item has a number of each group: a
			// group of more numbers than limit makes too many names.
			if b-a >= uint64(limit) || size+int(b-a+1) > limit {
				return nil, fmt.Errorf("more than %d names", MaxNodeList)
			}
			size += int(b - a + 1)
			// A range keeps the zero padding of its lower bound.
			width = max(width, len(lo), len(strconv.FormatUint(b, 10)))
			spans = append(spans, span{a, b, lo})
		}
		if count > limit/size {
			return nil, fmt.Errorf("more than %d names", MaxNodeList)
		}
		count *= size
		if longest += len(lit) + width; longest > maxNodeName {
			return nil, fmt.Errorf("name of more than %d characters", maxNodeName)
		}
		nums := make([]string, 0, size)
		for _, sp := range spans {
			for v := sp.a; v <= sp.b; v++ {
				num := strconv.FormatUint(v, 10)
				if pad := len(sp.lo) - len(num); pad > 0 {
					num = strings.Repeat("0", pad) + num
				}
				nums = append(nums, num)
			}
		}
		lits, groups = append(lits, lit), append(groups, nums)
		rest = rest[end+1:]
	}
	if strings.ContainsAny(rest, "] \t") {
		return nil, fmt.Errorf("bad name %s", clip(item))
	}
	if limit < 1 {
		return nil, fmt.Errorf("more than %d names", MaxNodeList)
	}
	if longest += len(rest); longest > maxNodeName {
		return nil, fmt.Errorf("name of %d characters or more (at most %d)", longest, maxNodeName)
	}
	lits = append(lits, rest)
	out := make([]string, 0, count)
	at := make([]int, len(groups)) // the number of each group in the next name
	var b strings.Builder
	for {
		b.Grow(longest)
		for g, nums := range groups {
			b.WriteString(lits[g])
			b.WriteString(nums[at[g]])
		}
		b.WriteString(lits[len(groups)])
		out = append(out, b.String())
		b.Reset()
		g := len(groups) - 1
		for ; g >= 0; g-- {
			if at[g]++; at[g] < len(groups[g]) {
				break
			}
			at[g] = 0
		}
		if g < 0 {
			return out, nil
		}
	}
}

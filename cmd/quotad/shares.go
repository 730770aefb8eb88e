package main

import (
	"context"
	"fmt"
	"math"
	"strconv"
	"time"

	"github.com/spf13/cobra"
	"google.golang.org/grpc"

	quotadv1 "github.com/quotad/quotad/api/quotad/v1"
	"github.com/quotad/quotad/rpc"
)

// sharesCmd lists the share holders of a path, of a domain, or of every domain
// (Quota.ShareStatus).
func sharesCmd() *cobra.Command {
	var (
		addr, domain string
		descs        []string
		asJSON       bool
	)
	cmd := &cobra.Command{
		Use:   "shares",
		Short: "List the share holders of a path, a domain or every domain: per lendable level rate, burst, expiry, demand, acknowledged, revoked (reader or admin; linearizable)",
		Example: "  quotad shares\n" +
			"  quotad shares --domain provider\n" +
			"  quotad shares --domain provider --descriptor endpoint=charges --json",
		RunE: func(cmd *cobra.Command, _ []string) error {
			if domain == "" && len(descs) > 0 {
				return fmt.Errorf("--descriptor needs --domain: the limits domain of the path (without both, every domain is listed)")
			}
			entries, err := descriptorFlag(descs, "endpoint=charges")
			if err != nil {
				return err
			}
			ctx, cancel := context.WithTimeout(cmd.Context(), 10*time.Second)
			defer cancel()
			var resp *quotadv1.ShareStatusResponse
			if err := call(ctx, addr, func(ctx context.Context, conn *grpc.ClientConn) error {
				resp, err = quotadv1.NewQuotaClient(conn).ShareStatus(ctx, &quotadv1.ShareStatusRequest{Domain: domain, Descriptors: entries},
					grpc.MaxCallRecvMsgSize(rpc.MaxForwardedAnswer)) // every holder of every domain: more than gRPC's default 4 MiB
				return err
			}); err != nil {
				return err
			}
			if asJSON {
				return printJSON(sharesJSON(resp))
			}
			w := cmd.OutOrStdout()
			if len(resp.Buckets) == 0 {
				where := domain
				if where == "" {
					where = "any domain"
				}
				fmt.Fprintf(w, "no lendable bucket with holders or lends in %s (applied index %d)\n", where, resp.AppliedIndex)
				return nil
			}
			now := time.Now()
			for _, b := range resp.Buckets {
				fmt.Fprintf(w, "%s\n  rate %s/s burst %s: lent %s/s burst %s to %d holders, reserve %s/s burst %s, central demand %s/s\n",
					b.Key, units(b.RateMicro), units(b.BurstMicro), units(b.LentRateMicro), units(b.LentBurstMicro), b.Holders,
					units(b.ReserveRateMicro), units(b.ReserveBurstMicro), units(b.CentralDemandMicro))
				for _, h := range resp.Holders {
					if h.Key != b.Key {
						continue
					}
					ack := fmt.Sprintf("acknowledged through seq %d", h.AckSeq)
					if !h.Acknowledged {
						ack = fmt.Sprintf("%d grants unacknowledged (acknowledged through seq %d)", h.Unacked, h.AckSeq)
					}
					fmt.Fprintf(w, "  %s/%s#%d  r %s/s  b %s  expires in %dms  demand %s  seq %d  %s\n",
						h.Owner, h.HolderId, h.Incarnation, units(h.RateMicro), units(h.BurstMicro), h.ExpiresInMs,
						perSecond(h.DemandMicro), h.Seq, ack)
					if h.OwnerRevoked {
						// Renewals are refused, but the grant in hand is honoured until it ends.
						fmt.Fprintf(w, "    revoked — grant valid until %s (renewals refused; it may still be spent until then)\n",
							now.Add(time.Duration(h.ExpiresInMs)*time.Millisecond).UTC().Format("15:04:05 UTC"))
					}
				}
			}
			return nil
		},
	}
	f := cmd.Flags()
	addrFlag(f, &addr)
	f.StringVar(&domain, "domain", "", "limits domain (none: every domain)")
	f.StringArrayVar(&descs, "descriptor", nil, "descriptor entry key=value, outermost first (repeatable); none: every lendable bucket of the domain")
	f.BoolVar(&asJSON, "json", false, "print JSON (rates and bursts in units, demand null when unknown)")
	return cmd
}

// perSecond formats a rate in micro-units per second as "N/s", or "unknown" ("unknown/s" read
// as a unit).
func perSecond(micro uint64) string {
	if micro == math.MaxUint64 {
		return "unknown"
	}
	return units(micro) + "/s"
}

// units formats micro-units as units (3 decimals at most), "unknown" for the max value.
func units(micro uint64) string {
	if micro == math.MaxUint64 {
		return "unknown"
	}
	return strconv.FormatFloat(math.Round(float64(micro)/1e3)/1e3, 'f', -1, 64)
}

type shareHolderJSON struct {
	Key          string   `json:"key"`
	Owner        string   `json:"owner"`
	HolderID     string   `json:"holder_id"`
	Incarnation  uint64   `json:"incarnation"`
	Rate         float64  `json:"rate"`
	Burst        float64  `json:"burst"`
	ExpiresInMs  int64    `json:"expires_in_ms"`
	Demand       *float64 `json:"demand"`
	Seq          uint64   `json:"seq"`
	AckSeq       uint64   `json:"ack_seq"`
	Acknowledged bool     `json:"acknowledged"`
	Unacked      uint32   `json:"unacked"`
	OwnerRevoked bool     `json:"owner_revoked"`
}

type shareBucketJSON struct {
	Key           string  `json:"key"`
	Rate          float64 `json:"rate"`
	Burst         float64 `json:"burst"`
	LentRate      float64 `json:"lent_rate"`
	LentBurst     float64 `json:"lent_burst"`
	ReserveRate   float64 `json:"reserve_rate"`
	ReserveBurst  float64 `json:"reserve_burst"`
	CentralDemand float64 `json:"central_demand"`
	Holders       uint32  `json:"holders"`
}

type sharesOut struct {
	AppliedIndex uint64            `json:"applied_index"`
	LeaderID     string            `json:"leader_id"`
	Buckets      []shareBucketJSON `json:"buckets"`
	Holders      []shareHolderJSON `json:"holders"`
}

func sharesJSON(resp *quotadv1.ShareStatusResponse) sharesOut {
	u := func(m uint64) float64 { return float64(m) / 1e6 }
	out := sharesOut{AppliedIndex: resp.AppliedIndex, LeaderID: resp.LeaderId, Buckets: []shareBucketJSON{}, Holders: []shareHolderJSON{}}
	for _, b := range resp.Buckets {
		out.Buckets = append(out.Buckets, shareBucketJSON{b.Key, u(b.RateMicro), u(b.BurstMicro), u(b.LentRateMicro), u(b.LentBurstMicro),
			u(b.ReserveRateMicro), u(b.ReserveBurstMicro), u(b.CentralDemandMicro), b.Holders})
	}
	for _, h := range resp.Holders {
		var d *float64
		if h.DemandMicro != math.MaxUint64 {
			v := u(h.DemandMicro)
			d = &v
		}
		out.Holders = append(out.Holders, shareHolderJSON{h.Key, h.Owner, h.HolderId, h.Incarnation, u(h.RateMicro), u(h.BurstMicro),
			h.ExpiresInMs, d, h.Seq, h.AckSeq, h.Acknowledged, h.Unacked, h.OwnerRevoked})
	}
	return out
}

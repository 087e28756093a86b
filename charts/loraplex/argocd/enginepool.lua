-- Argo CD health check for loraplex.dev/EnginePool (argocd-cm key
-- resource.customizations.health.loraplex.dev_EnginePool; docs/design/chart.md).
-- Reads what the operator writes (status.py pool_conditions): observedGeneration and
-- the kstatus conditions Ready, Reconciling and Stalled.
local hs = {status = "Progressing", message = "Waiting for the operator"}
if obj.status == nil or obj.status.conditions == nil then
  return hs
end
local s = obj.status
local generation = obj.metadata.generation
if generation ~= nil and s.observedGeneration ~= nil and s.observedGeneration < generation then
  hs.message = "Waiting for the operator to observe generation " .. generation
  return hs
end
local conditions = {}
for _, c in ipairs(s.conditions) do
  conditions[c.type] = c
end
local function text(c)
  if c.message ~= nil and c.message ~= "" then
    return c.reason .. ": " .. c.message
  end
  return c.reason
end
if conditions.Stalled ~= nil and conditions.Stalled.status == "True" then
  hs.status = "Degraded"
  hs.message = text(conditions.Stalled)
elseif conditions.Ready ~= nil and conditions.Ready.status == "True" then
  hs.status = "Healthy"
  hs.message = text(conditions.Ready)
elseif conditions.Reconciling ~= nil and conditions.Reconciling.status == "True" then
  hs.message = text(conditions.Reconciling)
end
return hs
